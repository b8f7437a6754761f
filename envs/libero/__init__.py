"""LIBERO on robosuite 1.5: the env wrapper (env.py), scene, fixtures, pick helpers and the scripted experts."""
