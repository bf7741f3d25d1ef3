"""Which tuned config runs a problem: the resolver (``resolver``: cache, database, service,
shipped tables, defaults), matching stored bests to a problem, bundles and snapshots,
the pinned snapshot (``TUNER_SNAPSHOT``), stored devices and the shipped measurements.
"""
