# Two commands from a fresh clone: `make quickstart` and `make test`. Both create .venv on first use.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: quickstart test lint clean

$(STAMP): requirements.txt
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -r requirements.txt
	touch $(STAMP)

quickstart: $(STAMP)
	$(PY) train_ppo.py --config configs/quickstart.yaml

lint: $(STAMP)
	$(VENV)/bin/ruff check .

test: lint
	OMP_NUM_THREADS=1 $(PY) -m pytest -q

clean:
	rm -rf $(VENV) runs .pytest_cache
