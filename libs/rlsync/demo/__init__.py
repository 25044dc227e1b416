"""The RL demo: a GRPO loop on a toy task that the tiny model learns in minutes on two CPU cores."""
