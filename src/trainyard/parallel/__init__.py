"""Applying the plan's strategy to a meta-built model, in one fixed order (`parallelize.apply`): activation
checkpointing and compile (`checkpointing`), FSDP2/HSDP sharding, materialising this rank's shards, loading its
rows (DDP: wrapped after load); timing the collectives (`comm`). Never decides the strategy (plan does) and
never imports the estimate, training or checkpoints."""
