"""Recipes build a ready-to-run job's assets — its data and an SFT warm start — out of a task (tasks/) and the
training steps (roles/sft.py), and so may import both roles/ and tasks/; tasks/ itself stays below roles/ (a task is
data, rewards and tools, which the roles use). Nothing in the library imports recipes/: only the entry points do
(train_ppo.py builds the quickstart's assets through recipes/quickstart.py), and `python -m recipes.calculator`
builds the calculator task's (tests/test_layering.py checks the layering)."""
