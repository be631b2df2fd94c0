"""Checks against reference code: our drafter, its export and its losses next to another project's
implementation of the same thing, on the same weights and inputs."""
