"""The audit's checks, one module per report group; CHECKS is the report order."""

from dsv41.checkpoint.audit.checks import config, csa2, dspark, engram, experts, index, inventory, packing, vision

CHECKS = [
    *config.CHECKS,
    *engram.CHECKS,
    *csa2.CHECKS,
    *inventory.CHECKS,
    *packing.CHECKS,
    *experts.CHECKS,
    *dspark.CHECKS,
    *vision.CHECKS,
    *index.CHECKS,
]
