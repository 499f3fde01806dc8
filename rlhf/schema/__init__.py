"""The pure types every layer shares: the run configuration's schema (:mod:`rlhf.schema.config`,
with :class:`ConfigError`) and the batches of a step (:mod:`rlhf.schema.batch`). Imports no other
rlhf module."""
