"""A mixture of experts: its rules, expert parallelism (the all-to-all dispatch) and its planner terms."""
