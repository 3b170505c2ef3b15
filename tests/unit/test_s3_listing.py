"""The signed path's ListObjectsV2 reader (weightcache.transfer.backends.s3.wire.listing_page): what
ElementTree read from the same pages, in any element order and namespace."""

from __future__ import annotations

from xml.etree import ElementTree

import pytest

from weightcache.transfer.backends.s3.wire import listing_page

NS = "http://s3.amazonaws.com/doc/2006-03-01/"
#: AWS's order: the objects first, EncodingType and the token after them; nested Owner
#: fields, a CommonPrefixes Prefix, an escaped token, a url-encoded key.
AWS_PAGE = f"""<?xml version="1.0" encoding="UTF-8"?>
<ListBucketResult xmlns="{NS}">
  <IsTruncated>true</IsTruncated>
  <Contents>
    <Key>m/r/model-00001-of-00002.safetensors</Key>
    <LastModified>2026-12-01T00:00:00.000Z</LastModified>
    <ETag>&quot;abc&quot;</ETag>
    <Size>1073741824</Size>
    <Owner><ID>x</ID><DisplayName>y</DisplayName></Owner>
    <StorageClass>STANDARD</StorageClass>
  </Contents>
  <Contents><Key>m/r/a%20b%2Bc.json</Key><Size>17</Size></Contents>
  <Name>models</Name>
  <Prefix>m/r/</Prefix>
  <CommonPrefixes><Prefix>m/r/sub/</Prefix></CommonPrefixes>
  <EncodingType>url</EncodingType>
  <KeyCount>2</KeyCount>
  <NextContinuationToken>1/ab+c&amp;d==</NextContinuationToken>
</ListBucketResult>
""".encode()
#: A prefixed namespace, EncodingType first, the last page (no token), an empty Key.
PREFIXED_PAGE = b"""<s3:ListBucketResult xmlns:s3="http://s3.amazonaws.com/doc/2006-03-01/">
<s3:EncodingType>url</s3:EncodingType><s3:IsTruncated>false</s3:IsTruncated>
<s3:Contents><s3:Key>m/r/SHA256SUMS</s3:Key><s3:Size>0</s3:Size></s3:Contents>
<s3:Contents><s3:Size>5</s3:Size></s3:Contents>
</s3:ListBucketResult>"""
EMPTY_PAGE = f'<ListBucketResult xmlns="{NS}"><IsTruncated>false</IsTruncated>'
EMPTY_PAGE = (EMPTY_PAGE + "<KeyCount>0</KeyCount></ListBucketResult>").encode()


def element_tree(body: bytes) -> tuple[list[tuple[str, int]], dict[str, str | None]]:
    """The page as the reader before expat read it, with ElementTree."""
    root = ElementTree.fromstring(body)
    objects = [
        (obj.findtext("{*}Key", ""), int(obj.findtext("{*}Size", "0")))
        for obj in root.iterfind("{*}Contents")
    ]
    names = ("EncodingType", "IsTruncated", "NextContinuationToken")
    return objects, {name: root.findtext(f"{{*}}{name}") for name in names}


@pytest.mark.parametrize("page", [AWS_PAGE, PREFIXED_PAGE, EMPTY_PAGE])
def test_a_page_reads_as_element_tree_read_it(page: bytes) -> None:
    objects, fields = listing_page(page)
    expected_objects, expected_fields = element_tree(page)
    assert objects == expected_objects
    assert {name: fields.get(name) for name in expected_fields} == expected_fields


def test_the_fields_of_a_page() -> None:
    objects, fields = listing_page(AWS_PAGE)
    assert objects == [
        ("m/r/model-00001-of-00002.safetensors", 1 << 30), ("m/r/a%20b%2Bc.json", 17)
    ]  # fmt: skip
    assert fields["Prefix"] == "m/r/"  # the result's, not the common prefix's
    assert (fields["IsTruncated"], fields["NextContinuationToken"]) == ("true", "1/ab+c&d==")


@pytest.mark.parametrize(
    "body",
    [
        b"<html>502 Bad Gateway",
        b"<R><Contents><Key>k</Key><Size>12x</Size></Contents></R>",
        b"<html><body>It works!</body></html>",
        b"<?xml version='1.0'?><Error><Code>Oops</Code></Error>",
        *(
            f"<ListBucketResult><Contents><Key>k</Key><Size>{size}</Size></Contents>"
            "</ListBucketResult>".encode()
            for size in ("\u0661\u0662", "\uff11", " 12", "+12", "1_000", "-1", "")
        ),
    ],
    ids=[
        "not-xml",
        "size-not-a-number",
        "html-well-formed",
        "another-document",
        "size-arabic-indic-digits",
        "size-fullwidth-digit",
        "size-space",
        "size-plus",
        "size-underscore",
        "size-negative",
        "size-empty",
    ],
)
def test_a_body_that_is_not_a_page_is_a_value_error(body: bytes) -> None:
    with pytest.raises(ValueError):
        listing_page(body)
