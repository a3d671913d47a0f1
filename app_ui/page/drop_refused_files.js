// The files the server refused as images (the hidden list `refused`: their paths) leave the message
// box; what the box holds now, the text typed meanwhile included, stays.
(refused, message) => {
  const paths = refused?.paths || [];
  return { ...message, files: (message?.files || []).filter((file) => !paths.includes(file.path)) };
}
