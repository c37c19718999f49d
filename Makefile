# Shortcuts for the README's commands.  Every target sets up .venv first if needed.
PY := .venv/bin/python

.PHONY: demo test bench bench-readme bench-pytest notebooks docs

demo:
	bash scripts/demo.sh

test:
	bash scripts/test.sh

bench:            ## the benchmark table: functrans | torch.func | loop | closed form (~5 min)
	bash scripts/setup.sh bench && $(PY) -m benchmarks

bench-readme:     ## the same, and write the table into README.md
	bash scripts/setup.sh bench && $(PY) -m benchmarks --update-readme

bench-pytest:     ## the same workloads under pytest-benchmark
	bash scripts/setup.sh dev && $(PY) -m pytest benchmarks/bench_workloads.py -p no:cacheprovider

notebooks:        ## rebuild the notebooks (execute and store with outputs)
	bash scripts/setup.sh dev && $(PY) notebooks/build.py

docs:             ## build the documentation site (warnings are errors) into docs/_build/html
	bash scripts/docs.sh
