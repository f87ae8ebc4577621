"""Integrations of kvatlas into other programs: each module here imports its program; the core never does."""
