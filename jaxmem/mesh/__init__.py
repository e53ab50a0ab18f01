"""Mesh axes and the sharding rules that map logical axes onto them."""
