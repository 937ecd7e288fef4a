"""Kits for plugin authors: ``trellis.kit.backend`` and ``trellis.kit.engine`` hold what one kind of plugin needs beyond ``trellis``."""
