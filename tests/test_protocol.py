"""What crosses the network (``common.protocol``, ``common.validation``): a sealed message opens to
the records it was sealed from, and a V a hair below zero is rounding only relative to h."""

import numpy as np
import pytest
from flwr.app import ConfigRecord, MetricRecord, RecordDict

from common import protocol as p
from common.validation import V_ROUNDING, InvalidReply, variance_metric


def test_a_sealed_message_opens_to_the_records_it_was_sealed_from():
    content = RecordDict({p.ARRAYS: p.pack({p.MODEL: {"head.bias": np.arange(3, dtype=np.float32)}}),
                          p.METRICS: MetricRecord({p.NUM_EXAMPLES: 7}), p.CONFIG: ConfigRecord({p.SERVER_ROUND: 2})})
    sealed = p.seal(content)
    assert p.is_sealed(sealed) and list(sealed.keys()) == [p.ENVELOPE]
    opened = p.unseal(sealed)
    assert sorted(opened.keys()) == sorted(content.keys())
    np.testing.assert_array_equal(p.sections_of(opened)[p.MODEL]["head.bias"], np.arange(3, dtype=np.float32))
    assert opened[p.METRICS][p.NUM_EXAMPLES] == 7 and opened[p.CONFIG][p.SERVER_ROUND] == 2
    # larger than one of Flower's array chunks: sent as it is
    assert p.seal(content, max_bytes=10) is content and not p.is_sealed(content)
    with pytest.raises(ValueError, match="not a sealed message"):
        p.unseal(content)


def test_a_slightly_negative_v_is_rounding_relative_to_h_and_at_least_to_one():
    """V is a difference of sums of squares: -1e-6 of ||h||^2 (or of 1, for a small h) is rounding
    and reads as 0; beyond that the reply is malformed."""
    small_h = np.full((2, 3), 0.1, dtype=np.float32)  # ||h||^2 = 0.06: the scale is 1
    assert variance_metric(-0.9 * V_ROUNDING, small_h) == 0.0
    with pytest.raises(InvalidReply, match="is negative"):
        variance_metric(-1.5 * V_ROUNDING, small_h)
    large_h = np.full((2, 50), 10.0, dtype=np.float32)  # ||h||^2 = 10,000
    assert variance_metric(-0.9e4 * V_ROUNDING, large_h) == 0.0
    with pytest.raises(InvalidReply, match="is negative"):
        variance_metric(-1.1e4 * V_ROUNDING, large_h)
    assert variance_metric(2.5, small_h) == 2.5
