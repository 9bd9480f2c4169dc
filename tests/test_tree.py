"""Tree topology, masks, positions and greedy acceptance on small hand-checked inputs."""

import pytest
import torch
from spectrt.runtime.decoding.policy import Calibration
from spectrt.runtime.decoding.tree import AUTO, TokenTrie, Tree, TreeError, greedy_accept, parse_tree_arg

pytestmark = pytest.mark.unit  # the fast tier: pure functions on small inputs, no model


def test_seed_example_mask():
    # root; A, B under root; C, D under A; E under B  (flattened: root A B C D E)
    tree = Tree((-1, 0, 0, 1, 1, 2))
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0],  # root
        [1, 1, 0, 0, 0, 0],  # A
        [1, 0, 1, 0, 0, 0],  # B
        [1, 1, 0, 1, 0, 0],  # C
        [1, 1, 0, 0, 1, 0],  # D
        [1, 0, 1, 0, 0, 1],  # E
    ], dtype=torch.bool)
    assert torch.equal(tree.mask, expected)
    assert tree.positions(10).tolist() == [10, 11, 11, 12, 12, 12]
    assert tree.levels == ((0,), (1, 2), (3, 4, 5))
    assert tree.ranks == (0, 0, 1, 0, 1, 0)


def test_expansion_vector_shape():
    tree = Tree.parse("3,2,2,1,1")
    assert len(tree) == 1 + 3 + 6 + 12 + 12 + 12
    assert [len(level) for level in tree.levels] == [1, 3, 6, 12, 12, 12]
    assert all(len(tree.children[i]) == 3 for i in tree.levels[0])
    assert all(len(tree.children[i]) == 2 for i in tree.levels[1] + tree.levels[2])
    # siblings share a position: prefix length + depth, never the flattened index
    positions = tree.positions(100)
    for level, nodes in enumerate(tree.levels):
        assert set(positions[list(nodes)].tolist()) == {100 + level}
    # every row of the mask is exactly the node's ancestor chain
    for i in range(len(tree)):
        chain, node = {i}, i
        while tree.parents[node] >= 0:
            node = tree.parents[node]
            chain.add(node)
        assert set(torch.nonzero(tree.mask[i]).flatten().tolist()) == chain


def test_chain_is_causal():
    tree = Tree.parse("1,1,1,1")
    assert torch.equal(tree.mask, torch.ones(5, 5, dtype=torch.bool).tril())


@pytest.mark.parametrize("spec", ["", "3,,2", "a,b", "2,0", "-1", "1.5"])
def test_malformed_tree_spec(spec):
    with pytest.raises(TreeError, match="e.g. 3,2,2,1,1"):
        Tree.parse(spec)


def test_non_bfs_parents_refused():
    with pytest.raises(TreeError, match="breadth-first"):
        Tree((-1, 0, 1, 0))
    with pytest.raises(TreeError, match="precede"):
        Tree((-1, 2, 0))


def test_greedy_accept_follows_target_argmax():
    tree = Tree((-1, 0, 0, 1, 1, 2))
    tokens = [7, 10, 11, 20, 21, 22]
    # target says: after root -> 11 (B), after B -> 22 (E), after E -> 5 (bonus)
    argmax = [11, 99, 22, 99, 99, 5]
    assert greedy_accept(tree, tokens, argmax) == ([0, 2, 5], 5)
    # nothing matches at the root: only the target's own token comes out
    assert greedy_accept(tree, tokens, [3, 0, 0, 0, 0, 0]) == ([0], 3)
    # second sibling at depth 2 (D under A)
    assert greedy_accept(tree, tokens, [10, 21, 0, 0, 8, 0]) == ([0, 1, 4], 8)


def _ancestors(tree: Tree, i: int) -> set[int]:
    chain = {i}
    while tree.parents[i] >= 0:
        i = tree.parents[i]
        chain.add(i)
    return chain


def test_trie_merges_proposers_with_shared_prefixes_once():
    trie = TokenTrie(7)
    a = trie.add(0, 10, 0.6, sampled=True)  # draft children, drawn from q
    b = trie.add(0, 11, 0.3, sampled=True)
    c = trie.add(a, 20, 0.4, sampled=True)
    path = trie.add_path([10, 21, 30], [0.9, 0.8, 0.7])  # a suffix match sharing the prefix 10
    assert path[0] == a and len(trie) == 6  # 10 appears once; 21 and 30 are new
    assert trie.point[a] and trie.sampled[a]  # verified as both kinds (see verify_sampled_batch)
    assert trie.sampled[b] and not trie.point[b] and trie.point[path[1]] and not trie.sampled[path[1]]
    assert trie.scores[a] == 0.9  # the better estimate of the merged node
    assert trie.add_path([10, 21], [0.1, 0.1]) == path[:2] and len(trie) == 6  # a repeated candidate adds nothing

    tree, order, tokens = trie.subtree(list(range(len(trie))))
    assert tokens == [7, 10, 11, 20, 21, 30]  # breadth-first; siblings in creation (draw) order
    assert tree.parents == (-1, 0, 0, 1, 1, 4)
    assert order[3] == c
    for i in range(len(tree)):  # each row of the mask is the node's ancestor chain; positions follow depth
        assert set(torch.nonzero(tree.mask[i]).flatten().tolist()) == _ancestors(tree, i)
    assert tree.positions(50).tolist() == [50, 51, 51, 52, 52, 53]
    # every root path of the merged tree is one proposer's candidate
    paths = {tuple(tokens[j] for j in sorted(_ancestors(tree, i))) for i in range(len(tree)) if not tree.children[i]}
    assert paths == {(7, 11), (7, 10, 20), (7, 10, 21, 30)}


def test_trie_scores_stay_monotone_and_best_nodes_connected():
    trie = TokenTrie(0)
    x = trie.add_path([1, 2, 3], [0.5, 0.9, 0.5])  # a child never scores above its parent
    assert [trie.scores[i] for i in x] == [0.5, 0.5, 0.5]
    y = trie.add(0, 4, 0.5)
    assert trie.best(3) == [0, x[0], y]  # ties go to the shallower node
    for budget in range(1, len(trie) + 1):
        tree, order, _ = trie.subtree(trie.best(budget))  # any top-B is a connected tree
        assert len(tree) == budget and order[0] == 0
    with pytest.raises(TreeError, match="parent"):
        trie.subtree([0, x[1]])


def test_a_draft_level_grows_ranks_and_feeds_the_trie():
    """A dynamic tree's draft level: `expand` scores each child as its parent's score times the edge table at the
    draft probability (merging a repeated token), `picks` ranks a depth's nodes whose parent the draft has read,
    `feed` gives them draft slots in order and the mask entries of their fed ancestors, `read_slots` stops at the
    first node the draft has not read."""
    trie = TokenTrie(5)
    edge = Calibration(draft=(0.1, 0.4, 0.8, 0.9)).draft_edge  # four probability buckets
    kids = trie.expand([0], [[7, 8]], [[0.9, 0.3]], edge)
    assert kids == [1, 2] and trie.scores[1:] == [0.9, 0.4]
    assert trie.picks(1, 1) == ([1], 0.9) and trie.picks(2, 2) == ([], 0.0)
    assert trie.feed([1, 2], 3) == ((0, 1), (3, 4), [7, 8], 1)  # each sees itself (its parent is the root)
    assert trie.draft_slot[1:] == [3, 4]
    grand = trie.expand([1, 2], [[9], [9]], [[1.0], [0.6]], edge)  # a 9 under each parent: two nodes
    assert grand == [3, 4] and trie.scores[3:] == [0.81, 0.4 * 0.8]
    assert trie.picks(2, 5) == ([3, 4], 0.81 + 0.4 * 0.8)
    assert trie.feed([4], 5) == ((0, 0), (5, 4), [9], 2)  # itself, then its fed parent's slot
    assert trie.read_slots([2, 4]) == [4, 5] and trie.read_slots([1, 3, 4]) == [3]  # node 3 was never fed
    assert trie.expand([0], [[7]], [[0.1]], edge) == [1] and trie.scores[1] == 0.9  # a merge keeps the better score
    assert trie.sorted_scores(2.0) == [1.8, 1.62, 0.8, 0.4 * 0.8 * 2.0]


def test_one_parser_reads_every_tree_argument_within_its_bounds():
    """`--tree`, a request's `tree` and `Pipeline.generate` read a tree argument the same way: auto, the target
    alone, or a static expansion refused past the deployment's depth and node bounds before any node is built."""
    assert parse_tree_arg(" Auto ") == AUTO
    assert [parse_tree_arg(s) for s in ("none", "AR", "0")] == [None, None, None]
    assert parse_tree_arg("2, 1") == Tree.parse("2,1") and len(Tree.parse("2,1")) == 5
    assert len(parse_tree_arg("2,2", max_depth=2, max_nodes=7)) == 7
    with pytest.raises(TreeError, match="max_tree_depth=2"):
        parse_tree_arg("1,1,1", max_depth=2)
    with pytest.raises(TreeError, match="max_tree_tokens=6"):
        parse_tree_arg("2,2", max_nodes=6)
    with pytest.raises(TreeError, match="max_tree_tokens=64"):
        parse_tree_arg("1000,1000,1000", max_nodes=64)  # refused from the counts, not by building a billion nodes
    with pytest.raises(TreeError, match="more than 4096 nodes"):  # `--tree` and bench specs carry no deployment limit
        parse_tree_arg("1000,1000,1000")
