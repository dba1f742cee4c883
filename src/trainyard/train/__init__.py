"""Training: the recipe read top to bottom (`recipe.run`) with its explicit loop, what the loop works on (`job`),
the loop's state in and out of full checkpoints (`state`), the optimizer and schedule (`optim`), and the
precision policy (`precision`). The highest room but the CLI: nothing below imports it."""
