# The README's two commands: `make demo` and `make test`. `.ci/run` runs `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Which CRC the ICRC check links ("isa-l" with libisal-dev's header, else "zlib"; setup.py --icrc
# decides). Asked each time make runs, after the system packages, never when the Makefile is read:
# the file changes only when the answer does, and then the build is redone.
ICRC := $(VENV)/.icrc

.PHONY: demo test lint system-deps isal build pcaps bench clean FORCE

# Each step in order (a sub-make for the build), so the CRC is decided after the packages are in.
# Main job: replay the bundled demo capture through the whole pipeline.
demo:
	@$(MAKE) --no-print-directory isal
	@$(MAKE) --no-print-directory build
	$(BIN)/mirrorckpt replay

# System packages the tests use (tshark, tcpdump, openssl, DPDK, iproute2, ISA-L); needs root, as CI has.
system-deps:
	./tools/install-system-deps.sh

# ISA-L alone, for the demo: installed when it can be (root), else the demo runs on zlib and says so.
isal:
	@./tools/install-system-deps.sh libisal-dev || \
		echo "note: the ICRC check runs on zlib's CRC-32 (several times slower); as root, apt-get install libisal-dev"

# The whole suite: its end-to-end and unit tests in two pytest processes at once (tests/run_suite.py);
# DeepSpeed (its adapter's test) is built against the installed torch, for the tests only.
# PYTEST_ARGS: a part of it, in one pytest process (CI runs all of it).
test:
	@$(MAKE) --no-print-directory system-deps
	@$(MAKE) --no-print-directory build
	@$(BIN)/python -c 'import deepspeed' 2>/dev/null || \
		$(BIN)/pip install -q --disable-pip-version-check --no-build-isolation 'deepspeed>=0.19,<0.20'
ifeq ($(strip $(PYTEST_ARGS)),)
	$(BIN)/python tests/run_suite.py
else
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)
endif

build: $(STAMP)
	@echo "mirrorckpt: built with the $$(cat $(ICRC)) CRC-32 for the ICRC check"

$(ICRC): FORCE
	@mkdir -p $(VENV)
	@want=$$($(PY) setup.py --icrc) || exit 1; [ "$$(cat $@ 2>/dev/null)" = "$$want" ] || echo "$$want" > $@

# The ICRC module is compiled anew (its flags change with the CRC, its sources do not), and the
# build must link what was asked for.
$(STAMP): $(ICRC) pyproject.toml setup.py $(wildcard */*.pyx */*.pxi */*/*.pyx */*/*.pxi)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check torch==2.13.0
	rm -f parser/roce/_fast.c parser/roce/_fast.*.so
	$(BIN)/pip install -q --disable-pip-version-check -e '.[test,plot,frameworks]'
	@built=$$($(BIN)/python -c 'from mirrorckpt.parser.roce import ICRC_BACKEND; print(ICRC_BACKEND)') && \
		[ "$$built" = "$$(cat $(ICRC))" ] || { echo "the build links the $$built CRC, not $$(cat $(ICRC))" >&2; exit 1; }
	touch $(STAMP)

lint: build
	$(BIN)/pip install -q --disable-pip-version-check -e '.[lint]'
	$(BIN)/ruff check .

# Regenerate tests/pcaps from the generator (deterministic).
pcaps: build
	./tests/pcaps/make.sh $(BIN)/mirrorckpt

bench: build
	$(BIN)/mirrorckpt bench

clean:
	rm -rf $(VENV) build *.egg-info */*.so */*.c */*/*.so */*/*.c
