"""The errors a user can fix. Each message names what is wrong (the key, flag, file or checkpoint)
and what to do about it; the commands print it after "error: " and exit non-zero.

A leaf module: it imports nothing, so models, data sources, engines and deploy targets raise
these without importing the modules that catch them (config imports the models' registry;
a model's check raising `shardlab.config.ConfigError` used to close that circle).
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration problem a user can fix; the message says how."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message says which one, what is wrong and what to do."""


class DiskFullError(CheckpointError):
    """A checkpoint could not be written: its filesystem is full or the quota reached. The message
    names the checkpoint, the intact one the same command resumes from, and the space needed."""


class RenderError(ValueError):
    """A deploy request that cannot be rendered; the message says what to change."""
