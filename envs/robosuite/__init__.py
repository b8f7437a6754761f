"""robosuite 1.5 backend (MuJoCo): the env wrapper (env.py), the kitchen suite (kitchen.py) and RoboCasa (robocasa.py)."""
