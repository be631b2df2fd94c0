"""`python -m pipeline.demo` (what `bash .ci/demo` runs); with `--real`, the paper's experiments on
SmolLM2-135M-Instruct instead (pipeline/demo/experiment.py, `bash .ci/demo --real`); with
`--record`, the quick and the default demo rerun into docs/ (pipeline/demo/record.py)."""

import sys

if __name__ == "__main__":
    if "--real" in sys.argv[1:]:
        from pipeline.demo.experiment import main

        main([a for a in sys.argv[1:] if a != "--real"])
    elif "--record" in sys.argv[1:]:
        from pipeline.demo.record import main

        main([a for a in sys.argv[1:] if a != "--record"], prog_name="python -m pipeline.demo --record")
    else:
        from pipeline.demo.run import main

        main()
