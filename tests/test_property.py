"""Property: any choice of legal cut-points trains exactly like eager training."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stagewise as sw
from tests.models.encdec import EncoderDecoder
from tests.models.gpt import lm_loss
from tests.reference import SGD, check_equal_training

MODEL = EncoderDecoder(layers=2)
PROBE = sw.compile(MODEL, 1, (torch.randint(0, 40, (4, 6)), torch.randint(0, 40, (4, 5))), loss_fn=lm_loss,
                   example_target=torch.randint(0, 40, (4, 5)))
LEGAL_STARTS = [c.after + 1 for c in PROBE.plan.cuts if c.legal]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(starts=st.lists(st.sampled_from(LEGAL_STARTS), min_size=1, max_size=3, unique=True), microbatches=st.sampled_from([1, 2, 4]))
def test_random_legal_cuts_train_like_eager(starts, microbatches):
    names = [PROBE.plan.layers[i].name for i in sorted(starts)]
    torch.manual_seed(1)
    batches = [((torch.randint(0, 40, (4, 6)), torch.randint(0, 40, (4, 5))), torch.randint(0, 40, (4, 5))) for _ in range(2)]
    pipe = check_equal_training(EncoderDecoder(layers=2), batches, len(names) + 1, loss_fn=lm_loss, optimizer=SGD,
                                microbatches=microbatches, split_points=names)
    assert [pipe.plan.layers[s.layers[0]].name for s in pipe.plan.stages[1:]] == names
