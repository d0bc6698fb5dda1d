"""Engines that run the same Federation and client runtime elsewhere: other processes, other machines."""
