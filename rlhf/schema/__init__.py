"""The pure types every layer shares: the run configuration's schema (:mod:`rlhf.schema.config`,
with :class:`ConfigError`), the batches of a step (:mod:`rlhf.schema.batch`) and the errors
several layers raise (:mod:`rlhf.schema.errors`). Imports no other rlhf module."""
