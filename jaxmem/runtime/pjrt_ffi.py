"""Registers an XLA FFI handler for the host programs a GPU plugin compiles.

A GPU program's host computation (compute_on("device_host")) is compiled by the CUDA plugin's own XLA:CPU,
which looks custom calls up in the plugin's FFI registry under the platform "Host". jaxlib's
`register_ffi_target(platform="cpu")` fills jaxlib's registry, and the plugin's Python hook registers for
"CUDA" only, so neither reaches it. The plugin's PJRT FFI extension does: its `register_handler` takes a
platform name. This module finds that extension on the plugin's PJRT_Api (the capsule jax's CUDA hook holds)
and calls it through ctypes, using the C layouts of xla/pjrt/c/pjrt_c_api.h and pjrt_c_api_ffi_extension.h.
"""
from __future__ import annotations

import ctypes

from jaxmem.runtime import compat

FEATURE = "FFI handlers for a GPU plugin's host programs (jaxmem.runtime.pjrt_ffi)"
_FFI_EXTENSION = 5  # PJRT_Extension_Type_FFI
_REGISTER_HANDLER_OFFSET = 40  # PJRT_FFI_Extension: base (24 bytes), type_register, user_data_add, register_handler


class _ExtensionBase(ctypes.Structure):
    pass


_ExtensionBase._fields_ = [("struct_size", ctypes.c_size_t), ("type", ctypes.c_int),
                           ("next", ctypes.POINTER(_ExtensionBase))]


class _RegisterHandlerArgs(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("target_name", ctypes.c_char_p),
                ("target_name_size", ctypes.c_size_t), ("handler", ctypes.c_void_p),
                ("platform_name", ctypes.c_char_p), ("platform_name_size", ctypes.c_size_t),
                ("traits", ctypes.c_uint32)]


_ARGS_SIZE = _RegisterHandlerArgs.traits.offset + ctypes.sizeof(ctypes.c_uint32)  # PJRT_STRUCT_SIZE
_REGISTER = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(_RegisterHandlerArgs))


class PluginUnavailable(RuntimeError):
    """No CUDA plugin, or one whose FFI extension cannot register handlers; the message is one line."""


def _plugin_api(plugin: str) -> int:
    """The address of the plugin's PJRT_Api (the capsule jax's registration hook for `plugin` was bound to)."""
    from jax._src import xla_bridge
    from jaxlib import xla_client

    xla_bridge._discover_and_register_pjrt_plugins()
    handler = getattr(xla_client, "_custom_callback_handler", {}).get(plugin)
    capsule = next((a for a in getattr(handler, "args", ()) if type(a).__name__ == "PyCapsule"), None)
    if capsule is None:
        raise PluginUnavailable(f"no {plugin} PJRT plugin is loaded (jax's {plugin} custom-call hook is missing)")
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype, get_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    return get_pointer(capsule, b"pjrt_c_api")


def _register_handler_fn(api: int):
    start = ctypes.c_void_p.from_address(api + ctypes.sizeof(ctypes.c_size_t)).value  # PJRT_Api.extension_start
    node = ctypes.cast(start, ctypes.POINTER(_ExtensionBase))
    while node:
        if node.contents.type == _FFI_EXTENSION:
            if node.contents.struct_size < _REGISTER_HANDLER_OFFSET + ctypes.sizeof(ctypes.c_void_p):
                break  # an FFI extension older than register_handler
            address = ctypes.c_void_p.from_address(ctypes.addressof(node.contents) + _REGISTER_HANDLER_OFFSET)
            return _REGISTER(address.value)
        node = node.contents.next
    raise PluginUnavailable("the CUDA plugin's PJRT FFI extension cannot register handlers (too old a plugin)")


def register_host_handler(target: str, handler_address: int, plugin: str = "CUDA") -> None:
    """Registers the typed FFI handler at `handler_address` (an XLA_FFI_Handler*) as `target` for the host
    programs `plugin` compiles. PluginUnavailable where it cannot; UnsupportedVersion outside the checked jax."""
    compat.require(FEATURE)
    register = _register_handler_fn(_plugin_api(plugin))
    name, platform = target.encode(), b"Host"
    args = _RegisterHandlerArgs(_ARGS_SIZE, name, len(name), handler_address, platform, len(platform), 0)
    if register(ctypes.byref(args)):
        raise PluginUnavailable(f"the {plugin} plugin refused to register the FFI handler {target} for its host")
