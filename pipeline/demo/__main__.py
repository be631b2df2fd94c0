"""`python -m pipeline.demo` (what `bash .ci/demo` runs); with `--real`, the paper's experiments on
SmolLM2-135M-Instruct instead (pipeline/demo/experiment.py, `bash .ci/demo --real`)."""

import sys

if __name__ == "__main__":
    if "--real" in sys.argv[1:]:
        from pipeline.demo.experiment import main

        main([a for a in sys.argv[1:] if a != "--real"])
    else:
        from pipeline.demo.run import main

        main()
