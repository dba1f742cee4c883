"""trainyard: one YAML-described LLM training job, from a CPU to many nodes."""

__version__ = "0.1.0"
