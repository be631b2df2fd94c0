"""The Ray side of stage 1: the actor pool of the cache build and the `alrira-cache` commands.
Nothing imports this package; the console script and `python -m ray_jobs` point here."""
