"""Dataset sources: each decodes one family of datasets to uint8 images at the classifier size
(``images.Loaded``); ``registry`` maps dataset names to them."""
