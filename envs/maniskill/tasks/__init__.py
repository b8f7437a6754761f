"""groundflow's own ManiSkill3 tasks (registered with ManiSkill on import) and their experts.

- ``GroundflowTabletop-v1`` (groundflow id ``maniskill/TabletopSuite-v1``): three cubes (red,
  green, blue) in a column of slots in front of the robot and two goal discs ("left" at +y,
  "right" at -y, seen from the robot). Twelve instructions are feasible from every initial state:
  push a cube to a goal (6), pick up a cube (3), stack one cube on another (3). The commanded task
  comes from ``reset(options={"task_id": i})`` and is never part of the state vector.
- ``GroundflowCollisionAvoidance-v1`` (``maniskill/CollisionAvoidance-v1``): move the TCP to a
  goal point. Demonstrations (``obstacles="none"``) go straight; evaluation puts kinematic boxes
  or spheres across the straight path and reports collisions and clearance.

World frame (ManiSkill's): table surface at z=0, robot base at (-0.615, 0, 0) facing +x, so +y is
the robot's left. All lengths are metres. Both tasks use ``pd_ee_delta_pos``: an action
``(dx, dy, dz, gripper)`` in [-1, 1]; the controller targets ``tcp + 0.1 * a[:3]`` each control
step (20 Hz); gripper +1 opens, -1 closes.

Modules: ``table_scene`` (what both tasks share: the Panda on ManiSkill's table, cameras, pose
readers, TCP steering), ``tabletop`` and ``collision_avoidance`` (one task and its expert each).
Importing this package imports ManiSkill and SAPIEN and registers both tasks with ManiSkill, so
``envs.maniskill.env`` imports it only when a ManiSkill env is made.
"""

# isort: off  (registration order with ManiSkill: tabletop first, as in the single module this package replaced)
from envs.maniskill.tasks.tabletop import TABLETOP_SUITE, GroundflowTabletopEnv, TabletopExpert, correlated_layout
from envs.maniskill.tasks.collision_avoidance import GroundflowCollisionAvoidanceEnv, StraightReachExpert
# isort: on

__all__ = ["GroundflowTabletopEnv", "TabletopExpert", "TABLETOP_SUITE", "correlated_layout",
           "GroundflowCollisionAvoidanceEnv", "StraightReachExpert"]
