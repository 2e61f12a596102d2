# The two commands of the README: `make demo` and `make test`. Both create .venv when needed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench env system-deps clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[test]'
	touch $(STAMP)

env: $(STAMP)

demo: $(STAMP)
	$(BIN)/ravq demo $(ARGS)

# Real parts some tests use (a Prometheus server, systemd-analyze, ip/tc); skipped with a reason if absent.
system-deps:
	@missing=""; \
	command -v prometheus >/dev/null || missing="$$missing prometheus"; \
	command -v systemd-analyze >/dev/null || missing="$$missing systemd"; \
	command -v ip >/dev/null || missing="$$missing iproute2"; \
	command -v nft >/dev/null || missing="$$missing nftables"; \
	if [ -n "$$missing" ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing:$$missing"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null) \
	    || echo "could not install$$missing; the tests that need them will be skipped"; \
	fi

# lint-imports checks the layers and import circles (pyproject.toml's import-linter contracts) first,
# then ruff checks the code (pyproject.toml's [tool.ruff]: private members, line length). The suite runs on
# two workers (pytest-xdist); the tests marked `alone` (they assert a measured rate or CPU share, which a
# test beside them would skew) run after, by themselves; exit 5 there means ARGS selected none of them.
test: $(STAMP) system-deps
	$(BIN)/lint-imports --no-cache
	$(BIN)/ruff check ravq brokers
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 2 -m 'not alone' --durations=30 $(ARGS)
	$(BIN)/python -m pytest -q -p no:cacheprovider -m alone --durations=5 $(ARGS) || [ $$? -eq 5 ]

bench: $(STAMP)
	for b in benchmarks/bench_*.py; do $(BIN)/python $$b --quick || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info
