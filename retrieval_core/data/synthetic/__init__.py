"""Deterministic, seeded, streaming synthetic image-text benchmark with detector-like region features.

Why it is hard in the way the paper needs
-----------------------------------------
Images come in *families* of ``family_size`` consecutive indices (same split). Member 0 is a base scene; member
``j`` differs from it in exactly ONE way, ``sibling_changes[j - 1]``:

* ``attribute`` - one focus object's colour is replaced by a colour found nowhere else in the scene ("a red cube"
  vs "a green cube"): a query-specific detail among the scene's other objects. Cross-attention checks the
  caption's colour words against the regions; a pooled embedding holds it as a small share of one vector;
* ``binding``   - the colours of the two focus objects are swapped ("a red cube and a blue ball" vs
  "a blue cube and a red ball");
* ``count``     - one focus object group has another number of instances ("two cubes" vs "three cubes");
* ``relation``  - the two focus groups trade places ("cube left of ball" vs "ball left of cube").

Binding and relation swaps are second-order (which colour or place goes with which object): pooled features
cannot show them at all, and telling them apart needs cross-modal reasoning that a cross-encoder must first
learn. The default family (base, attribute, binding, attribute) mixes the detail a reranker is for with a
binding swap that remains hard for both heads (docs/DATA.md).

Region features (``regions``) imitate a detector's box head; their codes add up, so a pooled embedding confuses
siblings while cross-attention over text + regions (+ boxes) can tell them apart. Everything that is not the
intended difference is drawn per family, so siblings really are near-duplicates.

Modules: ``spec`` (``SyntheticSpec``, the seeded streams), ``vocabulary`` (the English words of the world),
``scenes`` (families, splits, ``describe_scene``), ``regions`` (region features, ``generate_images``),
``captions`` (``generate_captions``; other languages through ``translation``, its grammar in ``grammar`` and
one lexicon per language: ``german``, ``french``, ``czech``), ``collection`` (a collection staged in memory).
"""
