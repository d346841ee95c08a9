"""trainpod for training frameworks, one module each; none is imported here (each imports
its framework, which takes seconds): ``from trainpod.integrations.lightning import ...``."""
