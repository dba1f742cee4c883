"""Training: the recipe read top to bottom (`recipe.run`) with its explicit loop, the job's model made ready
(`build`: meta build, the plan's strategy, parallelize, load), what the loop works on (`job`), the loop's state
in and out of full checkpoints (`state`), the optimizer and schedule (`optim`). The highest room but the CLI:
nothing below imports it, except `checkpoint.evaluate`, which builds the model exactly as training does."""
