"""Host offload's part of `jaxmem explain` (jaxmem.plan.buffer_kinds): a copy of the optimizer state made
while it lives in pinned host memory is that state brought to the device for the update."""
from __future__ import annotations


def fetched_state(b):
    if b.state.homes.optimizer_on_host and b.copy_of and b.copy_of.startswith(("state['master']", "state['opt']")):
        return "optimizer", "optimizer_fetch", f"{b.copy_of} brought from pinned host memory in {b.where}"


BUFFER_TERMS = (("before", "optimizer_copy", fetched_state),)
