"""`python -m pipeline.train` / `torchrun ... -m pipeline.train`: the same flags as `alrira-train`."""

from pipeline.cli import train_cli

if __name__ == "__main__":
    train_cli.main(prog_name="alrira-train")
