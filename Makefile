# gpupool: `make demo` and `make test` each set themselves up from a fresh clone.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of PyTorch for the example notebook; on a GPU host set
# TORCH_SPEC to the build for your CUDA version (e.g. TORCH_SPEC=torch).
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test install clean gpu-check labextension wheel version docs

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[all]"
	# An editable install leaves out the wheel's data files: link the committed prebuilt
	# JupyterLab extension in, as `jupyter labextension develop` would (a wheel installs it itself).
	mkdir -p $(VENV)/share/jupyter/labextensions
	ln -sfn "$(CURDIR)/labextension/prebuilt" $(VENV)/share/jupyter/labextensions/gpupool-lab
	# The JupyterHub tests need configurable-http-proxy (npm, into $(VENV)/chp) and the page
	# tests Debian's chromium (apt, as root); where either cannot be had they skip, saying why.
	command -v npm >/dev/null && npm install -s --no-audit --no-fund --prefix $(VENV)/chp configurable-http-proxy@4 \
		|| echo "make: configurable-http-proxy not installed (npm missing or failed): JupyterHub tests will skip"
	test -x /usr/bin/chromium || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && apt-get update -qq \
		&& DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
		|| echo "make: chromium not installed (needs root and apt-get): the page tests will skip"
	# The alert rules are checked with promtool (Debian's prometheus package, as root); without it that test skips.
	# The packaging test builds the wheel without isolation against the lowest setuptools pyproject.toml
	# allows (77.0.0 was yanked: 77.0.1), as distributions build it.
	$(BIN)/python -m pip install -q --no-deps --no-warn-conflicts --upgrade --target $(VENV)/setuptools-floor "setuptools==77.0.1"
	command -v promtool >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && apt-get update -qq \
		&& DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; } \
		|| echo "make: promtool not installed (needs root and apt-get): the alert rule test will skip"
	# The Slurm launcher's tests run a private Slurm (Debian's slurmctld, slurmd, slurm-client 22.05 and munge,
	# apt, as root; tests/support/slurm.py starts them on private ports); where they cannot be had those tests skip.
	command -v slurmd >/dev/null && command -v munged >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
		slurmctld slurmd slurm-client munge >/dev/null; } \
		|| echo "make: Slurm not installed (needs root and apt-get): the Slurm launcher tests will skip"
	touch $(STAMP)

# The wheel the images install (deploy/kubernetes/docker/): dist/gpupool-VERSION-py3-none-any.whl, the only
# gpupool wheel there (the Dockerfiles take the one they find), and all that .dockerignore sends to a builder.
wheel: install
	rm -f dist/gpupool-*.whl
	$(BIN)/python -m pip wheel -q --no-deps -w dist .

# The version (written once, in gpupool/__init__.py), for image tags: $$(make -s version).
version:
	@sed -n 's/^__version__ = "\(.*\)"/\1/p' gpupool/__init__.py

# The documentation site (docs/conf.py: README.md, docs/ and the deploy READMEs) into docs/_build/html.
docs: install
	$(BIN)/python -m sphinx -W --keep-going -q -b html docs docs/_build/html

demo: install
	$(BIN)/gpupool demo

test: install
	$(BIN)/python -m pytest -q

# On a host with an NVIDIA GPU: NVML inventory, two 0.5 leases, the 0.25 memory cap,
# MPS, slice overhead; writes gpu-check.json/.md to $(OUT) or a temporary directory.
# Without a GPU it reports "no GPU found" and exits 0.
gpu-check: install
	$(BIN)/python bench/gpu_check.py $(if $(OUT),--out $(OUT))

# Rebuild the JupyterLab extension (labextension/src/*.ts) into labextension/prebuilt/, which is
# committed (so `make install` needs no npm): needs node 18+ and npm, and JupyterLab from `make install`.
labextension: install
	cd labextension && npm ci --no-audit --no-fund && PATH="$(CURDIR)/$(BIN):$$PATH" npm run build

clean:
	rm -rf $(VENV) .state build dist docs/_build *.egg-info
