"""The stages of one planning pass, one module each, run in order by ``decide.STAGES``."""
