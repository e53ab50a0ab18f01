"""Which plug-in (jaxmem.core.plugins) a config asks for: the first of PLUGINS that takes it, else a full
fine-tune's hooks."""
from __future__ import annotations

from jaxmem.config.schema import Config
from jaxmem.core.plugins import ProgramPlugin
from jaxmem.core.update_in_backward import UpdateInBackward
from jaxmem.lora.plugin import LoraPlugin

PLUGINS = (LoraPlugin, UpdateInBackward)  # at most one applies: jaxmem.config.validate refuses combining them


def plugin_for(cfg: Config) -> ProgramPlugin:
    for kind in PLUGINS:
        plugin = kind.from_config(cfg)
        if plugin is not None:
            return plugin
    return ProgramPlugin()
