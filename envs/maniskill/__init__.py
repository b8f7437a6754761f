"""ManiSkill3 backend (SAPIEN, CPU): the env wrapper (env.py), its experts (experts.py) and groundflow's own tasks (tasks/)."""
