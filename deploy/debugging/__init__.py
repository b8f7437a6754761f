"""Counterfactual world-model debugging: the search (search.py), hybrid rollouts, injected faults and the report."""
