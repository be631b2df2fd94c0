"""`python -m pipeline.demo` (what `bash .ci/demo` runs)."""

from pipeline.demo.run import main

if __name__ == "__main__":
    main()
