"""What the harness's tests share: a run stopped mid-way, as a kill would stop it."""


class Interrupt(Exception):
    pass


def stop_at(stop: int):
    """A progress callback for train_simulated that raises Interrupt when step ``stop`` is done."""
    def progress(step, loss):
        if step == stop:
            raise Interrupt
    return progress
