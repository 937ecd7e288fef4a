"""The ``ray`` controller, registered by entry point (``trainer.controller=ray``)."""

from __future__ import annotations

import trellis


@trellis.hookimpl
def trellis_register(registry):
    from trellis_ray.controller import RayController

    registry.add("controller", "ray", RayController)
