"""Shipped measurements: the first run already fast, before any sweep.

A table per GPU model (``h200.json`` beside this file) holds, for the problems of a suite
(``standard``), each implementation's stored best as a sweep left it: config, TFLOP/s (the
head-to-head's median where there was one), kernel version. The resolver (``tuner.lookup.resolver``)
consults it after the local database and the service and before the template defaults (unless
``TUNER_SHIPPED=off``; or the tables of the folder it names instead); the
dispatcher prices from it as from a database, so with an empty database ours runs only where
the table measured it faster than torch SDPA on the same bucket, or on a neighbour by the
margin (docs/DISPATCH.md). ``tuner ship`` regenerates a table from a database or a bundle.

* ``tuner.lookup.shipped.table``: the format, and which devices a table answers for.
* ``tuner.lookup.shipped.configs``: the tables as the resolver matches them.
* ``tuner.tuning.ship``: a table made from stored bests (``tuner ship``), beside the sweeps
  that store them.
"""

from tuner.lookup.shipped.configs import PACKAGED_DIR, ShippedConfigs, shipped_folder
from tuner.lookup.shipped.table import ShippedError, ShippedTable, file_name, load_table

__all__ = ["PACKAGED_DIR", "ShippedConfigs", "ShippedError", "ShippedTable", "file_name",
           "load_table", "shipped_folder"]
