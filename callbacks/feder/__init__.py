"""FedER (experience replay with privacy-preserving GANs): its callback and every part only it uses."""

from callbacks.feder.experience_replay import ExperienceReplay

__all__ = ["ExperienceReplay"]
