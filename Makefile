# Two entry points, each installing what it needs first (see README "Quick start"; every target: docs/DEVELOPMENT.md).
#   make demo   run the embedded default: local Kafka + S3, tiny trained checkpoint, sample requests, re-evaluation
#   make test   lint (ruff, import-linter, mypy, the docs site), then the test suite (starts its own Kafka and S3 servers)

PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
# make test runs the suite on this many pytest-xdist workers (each starts its own Kafka broker and S3 store).
# Three on two cores: the scenarios wait on worker processes, rebalances and timeouts, and a third worker fills
# that time (measured on the 2-core machine: 2 workers 754 s, 3 workers 571 s, 4 workers 632 s). A module whose own
# models take a minute to load marks itself with an xdist_group, and --dist loadgroup keeps it on one worker.
TEST_WORKERS ?= 3
# mypy's cache outside the checkout: another checkout on the same machine (CI's fresh clone) starts warm, 1 s
# instead of 37. mypy compares each cached module's hash with its source, so a stale entry is checked again.
MYPY_CACHE ?= $(HOME)/.cache/d3stream/mypy

# The project's own modules as .pyc too (the suite starts about a hundred Python processes; the install compiled
# the rest): compileall skips what is up to date, and an edited module's stale .pyc is only ignored.
COMPILE_PROJECT := $(VENV)/bin/python -m compileall -q -j 0 d3stream clients/python/d3stream_client tests >/dev/null

.PHONY: demo test test-fast install lint docs schemas clean constraints

# The packages are installed by uv (from PyPI, like pip): it fetches and unpacks the 6 GB of wheels (torch and its
# CUDA libraries) side by side, in about half of pip's time on a fresh machine, and in seconds from its cache.
# --compile-bytecode writes every module's .pyc at install, as pip does and uv does not by default: where
# PYTHONDONTWRITEBYTECODE is set (this machine, CI's, the images) nothing would ever write them, and every Python
# process would compile torch and transformers from source again (14 s to import the model code instead of 6).
$(STAMP): pyproject.toml clients/python/pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet uv==0.13.9
	$(VENV)/bin/uv pip install --python $(VENV)/bin/python --compile-bytecode -c constraints.txt -e ./clients/python -e '.[test]'
	@command -v java >/dev/null || { echo "Java 17+ is needed for the local Kafka and S3 servers (apt-get install openjdk-17-jre-headless)"; exit 1; }
	@command -v mvn >/dev/null || { echo "Maven is needed to fetch the Kafka and S3Proxy jars (apt-get install maven)"; exit 1; }
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/d3stream demo

test: lint
	$(COMPILE_PROJECT)
	D3STREAM_REQUIRE_INFRA=1 $(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup

# The quick loop (tests/conftest.py says what each folder and marker means): tests/unit, the tests that need no
# JVM (no Kafka broker or S3 store) and start no other Python process, less the slow ones (training, extra
# models, fuzzing through a model).
test-fast: $(STAMP)
	$(COMPILE_PROJECT)
	$(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup tests/unit -m "not slow"

# The docs site (mkdocs.yml) is built --strict: a dead link or anchor, or a page missing from the nav, fails
# (not --quiet, which hides the warnings --strict counts).
lint: $(STAMP)
	$(VENV)/bin/ruff check d3stream tests clients/python
	$(VENV)/bin/lint-imports
	MYPY_CACHE_DIR=$(MYPY_CACHE) $(VENV)/bin/mypy
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# The documentation site: docs/ with MkDocs and the Material theme, into site/ (`mkdocs serve` to browse it live).
# NO_MKDOCS_2_WARNING silences the banner mkdocs-material prints about MkDocs 2.0.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

schemas: $(STAMP)
	$(VENV)/bin/python -m d3stream_client.schemas schemas

# constraints.txt anew: the newest versions pyproject.toml allows, resolved in a scratch venv. Run make test
# after it and commit both files.
constraints:
	rm -rf .venv-refresh
	$(PYTHON) -m venv .venv-refresh
	.venv-refresh/bin/pip install --upgrade pip
	.venv-refresh/bin/pip install ./clients/python '.[test]'
	{ sed -n '1,3p' constraints.txt; .venv-refresh/bin/pip freeze --exclude-editable | grep -v '^d3stream'; } > constraints.txt.new
	mv constraints.txt.new constraints.txt
	rm -rf .venv-refresh

clean:
	rm -rf $(VENV) .pytest_cache
