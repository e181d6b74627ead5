"""The conversation-prefix token cache in front of llama-server's /tokenize (no runtime)."""

from kvstream.backends.llamacpp.tokens import ConversationTokenCache

SYSTEM = {"role": "system", "content": "be brief"}
Q1 = {"role": "user", "content": "hi"}
A1 = {"role": "assistant", "content": "hello"}
Q2 = {"role": "user", "content": "bye"}


def test_learns_only_prefixes_that_agree_with_the_full_tokenization():
    cache = ConversationTokenCache()
    cache.learn([SYSTEM], "<s>be brief|", [1, 2, 3], full_tokens=[1, 2, 3, 4])
    cache.learn([SYSTEM, Q1], "<s>be brief|hi|", [1, 2, 9], full_tokens=[1, 2, 3, 4])
    assert len(cache.entries) == 1


def test_lookup_takes_the_longest_known_prefix_whose_text_leads_the_prompt():
    cache = ConversationTokenCache()
    cache.learn([SYSTEM], "S|", [1], [1, 5])
    cache.learn([SYSTEM, Q1], "S|hi|", [1, 7], [1, 7, 8])
    entry = cache.lookup([SYSTEM, Q1, A1, Q2], "S|hi|hello|bye|")
    assert entry is not None and entry.tokens == [1, 7]
    # A template that rendered the earlier messages differently this time: not spliced.
    assert cache.lookup([SYSTEM, Q1, A1, Q2], "X|hi|hello|bye|") is None


def test_a_prefix_that_once_disagreed_is_never_used_again():
    cache = ConversationTokenCache()
    cache.learn([SYSTEM], "S|", [1], [1, 5])
    cache.lookup([SYSTEM, Q1], "S|hi|").verified = False
    assert cache.lookup([SYSTEM, Q1], "S|hi|") is None


def test_capacity_evicts_the_least_recently_used():
    cache = ConversationTokenCache(capacity=2)
    for i in range(3):
        cache.learn([{"role": "system", "content": str(i)}], f"{i}|", [i + 1], [i + 1, 0])
    assert cache.lookup([{"role": "system", "content": "0"}, Q1], "0|hi|") is None
    assert cache.lookup([{"role": "system", "content": "2"}, Q1], "2|hi|") is not None
