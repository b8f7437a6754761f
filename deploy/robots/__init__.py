"""Robots: the Robot protocol (base.py), the simulated robot, the Franka/UR/xArm drivers, kinematics and cameras."""
