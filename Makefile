# `make bench`: correctness check + benchmark table (CPU-only machines: interpreter check, no timings).
# `make test`: the test suite (kernels through Triton's interpreter on CPU machines).
# Both create .venv with the pinned CPU set when it is missing; on a GPU machine, set PYTHON to an
# environment that has CUDA torch and triton (e.g. `make bench PYTHON=python3 VENV=`).

VENV ?= .venv
PYTHON ?= $(VENV)/bin/python
PINS = torch==2.13.0 triton==3.6.0 "numpy<2.4"

.PHONY: bench bench-full bench-train test clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q $(PINS) pytest pytest-xdist matplotlib tqdm "transformers>=4.56"
	$(VENV)/bin/pip install -q --no-deps -e .
	touch $@

bench: $(if $(VENV),$(VENV)/.installed)
	$(PYTHON) -m flashtile bench prefill --quick

bench-full: $(if $(VENV),$(VENV)/.installed)
	$(PYTHON) -m flashtile bench prefill

bench-train: $(if $(VENV),$(VENV)/.installed)
	$(PYTHON) -m flashtile bench train

test: $(if $(VENV),$(VENV)/.installed)
	OMP_NUM_THREADS=1 $(PYTHON) -m pytest -q -n 2 -p no:logging tests

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
