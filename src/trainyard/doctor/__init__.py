"""Preflight checks of a machine, and with `--nnodes` of the cluster, before a job burns hours (`run`), and of a
job's inputs before torch is imported (`preflight`). This package imports nothing: `trainyard train` imports
`preflight` to fail on bad input in a fraction of a second, and `import torch` alone takes seconds."""
