"""Loading the run configuration (one layer above its schema, :mod:`rlhf.schema.config`).

* :mod:`rlhf.config.load`: yaml + dotted overrides -> the typed config (:func:`load_config`);
* :mod:`rlhf.config.verl`, :mod:`rlhf.config.verl_keys`: verl's key names -> ours;
* :mod:`rlhf.config.hub`: Hugging Face Hub names -> local snapshots;
* :mod:`rlhf.config.checks`: value checks across keys; :mod:`rlhf.config.hints`: nearest valid key names.
"""
