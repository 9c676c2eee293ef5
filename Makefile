# The README's two commands: `make demo` and `make test`. `.ci/run` runs `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The build links ISA-L for the ICRC when libisal-dev is there: installing it later rebuilds.
STAMP := $(VENV)/.installed$(if $(wildcard /usr/include/isa-l/crc.h),-isal)

.PHONY: demo test lint system-deps pcaps bench clean

$(STAMP): pyproject.toml setup.py $(wildcard */*.pyx */*.pxi */*/*.pyx */*/*.pxi)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install -q --disable-pip-version-check -e '.[test,plot]'
	touch $(STAMP)

# Main job: replay the bundled demo capture through the whole pipeline.
demo: $(STAMP)
	$(BIN)/mirrorckpt replay

# System packages the tests use (tshark, tcpdump, openssl, DPDK, iproute2); needs root, as CI has.
system-deps:
	./tools/install-system-deps.sh

test: system-deps $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/pip install -q --disable-pip-version-check -e '.[lint]'
	$(BIN)/ruff check .

# Regenerate tests/pcaps from the generator (deterministic).
pcaps: $(STAMP)
	./tests/pcaps/make.sh $(BIN)/mirrorckpt

bench: $(STAMP)
	$(BIN)/mirrorckpt bench

clean:
	rm -rf $(VENV) build *.egg-info */*.so */*.c */*/*.so */*/*.c
