"""Layer 5, building a run from a config: plan the layout (every check that needs no process group), then the
data, the parallelised model, the optimizer, the checkpointer and the Trainer; and the memory planner's
estimator. The entry points (layer 6) and the tools call these builders; nothing below them does."""
