"""Framework integrations, importable as ``nemo_dcr.callbacks``.

The Lightning trainer callback, Megatron sharded snapshots and the rollout loader land here
(issue #4). They call the framework-free API of ``nemo_dcr`` (``diff``/``apply`` with
``ShardSpec``), which is what this package is built on.
"""
__all__: list = []
