"""`python -m ray_jobs ARGS` is `alrira-cache ARGS`."""

from ray_jobs.cli import cache_cli

if __name__ == "__main__":
    cache_cli.main(prog_name="alrira-cache")
